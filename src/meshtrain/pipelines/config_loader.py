"""The project's Kedro configuration: Kedro's config loader, refusing an unknown `--env`
in one line and without OmegaConf's deprecation warnings about Kedro's own resolvers
(`settings.CONFIG_LOADER_CLASS`), and what the project reads through it beside the
parameters: mlflow.yml and the tracking server's credentials (the choice of server is
`tracking.project_server`'s)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from kedro.config import MissingConfigException, OmegaConfigLoader

from meshtrain.config import Refused
from meshtrain.refusals import show_refusals_plainly
from meshtrain.tracking.project_server import (
    checked_settings,
    needs_credentials,
    project_server,
)
from meshtrain.tracking.servers import TrackingServer


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


def _credentials_of(loader: OmegaConfigLoader) -> dict[str, Any]:
    try:
        return dict(loader["credentials"] or {})
    except MissingConfigException:
        return {}


def load_credentials(config_loader: OmegaConfigLoader, env: str) -> tuple[dict[str, Any], list]:
    """The credentials config of the run env (base + `--env`), completed by conf/local's.

    Kedro reads conf/local only when it is the run env, yet conf/local is the
    git-ignored home of secrets; so for `--env team` the entries of
    conf/local/credentials.yml fill in those the run env lacks.
    """
    base_env = getattr(config_loader, "base_env", None) or "base"
    credentials = _credentials_of(config_loader)
    looked_in = [f"conf/{base_env}/credentials*.yml", f"conf/{env}/credentials*.yml"]
    if env != "local":
        local = OmegaConfigLoader(
            conf_source=str(config_loader.conf_source),
            env="local",
            base_env=base_env,
            default_run_env="local",
        )
        credentials = {**_credentials_of(local), **credentials}
        looked_in.append("conf/local/credentials*.yml")
    return credentials, looked_in


def mlflow_settings(config_loader: OmegaConfigLoader, env: str | None) -> dict[str, Any]:
    """mlflow.yml of the run env over the defaults; an unknown key (a typo) is refused."""
    try:
        configured = config_loader["mlflow"] or {}
    except (KeyError, MissingConfigException):
        configured = {}
    return checked_settings(configured, env)


def project_tracking_server(
    config_loader: OmegaConfigLoader,
    env: str | None,
    project_path: Path,
    settings: dict[str, Any] | None = None,
) -> TrackingServer:
    """Where this project's runs go in `env` (`tracking.project_server`'s precedence), the
    credentials read only where the settings name an entry; for the MLflow hook and for
    any other caller that must find the same runs (e.g. a command that reads them back)."""
    settings = settings if settings is not None else mlflow_settings(config_loader, env)
    credentials: dict[str, Any] = {}
    looked_in: list[str] = []
    if needs_credentials(settings):
        credentials, looked_in = load_credentials(config_loader, env or "local")
    return project_server(settings, credentials, looked_in, project_path)
