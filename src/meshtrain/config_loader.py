"""The project's config loader: Kedro's, refusing an environment that has no folder.

Kedro itself meets a missing `conf/<env>` only when it first reads the catalog, and
ends `kedro run --env gpux` with a page of traceback and the folder's path; this says
which environment was asked for and which ones exist, before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kedro.config import OmegaConfigLoader

from meshtrain.config import Refused


class MissingEnvironmentError(Refused):
    """`--env` (or KEDRO_ENV) names an environment with no folder under conf/."""


class ProjectConfigLoader(OmegaConfigLoader):
    def __init__(self, conf_source: str, env: str | None = None, **kwargs: Any) -> None:
        super().__init__(conf_source, env=env, **kwargs)
        conf = Path(conf_source)
        if env and env != self.base_env and conf.is_dir() and not (conf / env).is_dir():
            from meshtrain.hooks import show_refusals_plainly  # noqa: PLC0415

            show_refusals_plainly()  # the context, whose hook installs it, comes later
            existing = sorted(p.name for p in conf.iterdir() if p.is_dir() and p.name != "local")
            raise MissingEnvironmentError(
                f"--env {env}: there is no environment {env!r} (no folder {conf / env}). "
                f"The environments are: {', '.join(existing)} (and local, read on top of "
                "the one chosen). Pass one of them, or create the folder."
            )
