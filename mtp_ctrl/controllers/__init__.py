"""Text generation controllers: the step loop, sampling, acceptance, proposers."""
