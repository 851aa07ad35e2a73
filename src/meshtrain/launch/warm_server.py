"""What the warm-rank server imports before it serves (`launch.warm.PRELOAD`), and only
the server: it never acts on a stop signal (SIGINT and SIGTERM do not stay blocked
through its start, so they are ignored here), then the engine the ranks run, imported
once (`warm.import_engine`). Each rank restores the signals' defaults
(`warm.warm_rank`). Nothing else imports this module.
"""

import signal

from meshtrain.launch.warm import STOP_SIGNALS, import_engine

for _number in STOP_SIGNALS:
    signal.signal(_number, signal.SIG_IGN)

import_engine()
