"""What the warm-rank server imports before it serves (`launch.warm.PRELOAD`), and only
the server: it never acts on a stop signal (SIGINT and SIGTERM do not stay blocked
through its start, so they are ignored here), then the engine the ranks run, imported
once. Each rank restores the signals' defaults (`warm.warm_rank`). Nothing else imports
this module.
"""

import signal

import meshtrain.launch.worker  # noqa: F401  (torch, transformers, the trainer: imported once)
from meshtrain.launch.warm import STOP_SIGNALS
from meshtrain.tracking.rank_metrics import import_client

for _number in STOP_SIGNALS:
    signal.signal(_number, signal.SIG_IGN)

import_client()  # rank 0's MLflow client: imported here, not while rank 0 builds its model
