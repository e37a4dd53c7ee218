"""``python -m mtp_ctrl.serve``: see :mod:`mtp_ctrl.cli.serve`."""

from mtp_ctrl.cli.serve import main

main()
