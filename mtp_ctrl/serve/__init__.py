"""An OpenAI-compatible HTTP server for the controller: ``python -m mtp_ctrl.serve`` (or
``mtp-ctrl-serve``; the program is :mod:`mtp_ctrl.cli.serve`).

- :mod:`~mtp_ctrl.serve.api`: the FastAPI app (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``) and the request checks;
- :mod:`~mtp_ctrl.serve.engine`: the engine loop (the process that owns the controller), and the
  follower loop of the other tensor-parallel ranks;
- :mod:`~mtp_ctrl.serve.frontend`: the HTTP frontend process (spawned by the engine's) and its
  end of the engine connection;
- :mod:`~mtp_ctrl.serve.text`: tokenizer adapters and the streaming detokenizer;
- :mod:`~mtp_ctrl.serve.metrics`: the Prometheus counters.

Needs the ``serve`` extra (``pip install "mtp_ctrl[serve]"``: FastAPI and uvicorn).
"""
