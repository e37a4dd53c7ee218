"""Plain vs speculative generation on the shipped demo model: what ``make demo`` runs.

The program lives in the package, :mod:`mtp_ctrl.cli.generate` (installed as the console script
``mtp-ctrl-generate``); ``python examples/generate.py --help`` lists its options.
"""

from mtp_ctrl.cli.generate import main

if __name__ == "__main__":
    main()
