"""The project's config loader: Kedro's, refusing an unknown `--env` in one line, and
without OmegaConf's deprecation warnings about Kedro's own resolvers."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from kedro.config import OmegaConfigLoader

from meshtrain.config import Refused
from meshtrain.hooks.refusals import show_refusals_plainly


def quiet_kedro_resolver_warnings() -> None:
    """Kedro registers its `globals` and `runtime_params` resolvers with OmegaConf's
    `register_new_resolver()`, which OmegaConf 2.4 deprecates with a 15-line warning,
    three times at the start of every run; a user cannot act on it (Kedro will move to
    `register_resolver()`). Silence exactly that warning, from exactly Kedro's loader."""
    warnings.filterwarnings(
        "ignore",
        message=r"register_new_resolver\(\) is deprecated",
        category=UserWarning,
        module=r"kedro\.config\.omegaconf_config",
    )


quiet_kedro_resolver_warnings()  # before settings.py hands Kedro this loader


class MissingEnvironmentError(Refused):
    """`--env` (or KEDRO_ENV) names an environment with no folder under conf/."""


class ProjectConfigLoader(OmegaConfigLoader):
    """Kedro's loader, refusing at once an environment that has no folder: Kedro itself
    meets a missing `conf/<env>` only when it first reads the catalog, and ends
    `kedro run --env gpux` with a page of traceback and the folder's path."""

    def __init__(self, conf_source: str, env: str | None = None, **kwargs: Any) -> None:
        super().__init__(conf_source, env=env, **kwargs)
        conf = Path(conf_source)
        if env and env != self.base_env and conf.is_dir() and not (conf / env).is_dir():
            show_refusals_plainly()  # the context, whose hook installs it, comes later
            existing = sorted(p.name for p in conf.iterdir() if p.is_dir() and p.name != "local")
            raise MissingEnvironmentError(
                f"--env {env}: there is no environment {env!r} (no folder {conf / env}). "
                f"The environments are: {', '.join(existing)} (and local, read on top of "
                "the one chosen). Pass one of them, or create the folder."
            )
