"""The command-line programs that ship with the package (console scripts of pyproject.toml):
``mtp-ctrl-generate`` (:mod:`mtp_ctrl.cli.generate`, what ``make demo`` runs), with what they
share: the model options and their loading (:mod:`~mtp_ctrl.cli.model_source`), the byte-level text corpus
of the demo (:mod:`~mtp_ctrl.cli.byte_corpus`), the draft
heads' checkpoint readers (:mod:`~mtp_ctrl.cli.draft_heads`) and the process-group set-up
(:mod:`~mtp_ctrl.cli.distributed`). This is the scripts' layer, above `controllers`: no other part of
the package imports it (examples, benchmarks and tests do).
"""
