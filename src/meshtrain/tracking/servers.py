"""Where a run is logged: the tracking server from the environment, a credentials entry
or mlflow.yml, in the order of `meshtrain.tracking.project_server`'s docstring. Pure
functions of their inputs (no Kedro, no MLflow calls), so they are tested without a
project.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from meshtrain.config import Refused

# MLflow's own variables; each wins over what meshtrain's config says.
URI_VARIABLE = "MLFLOW_TRACKING_URI"
USERNAME_VARIABLE = "MLFLOW_TRACKING_USERNAME"
PASSWORD_VARIABLE = "MLFLOW_TRACKING_PASSWORD"


class TrackingConfigError(Refused, ValueError):
    """The MLflow tracking settings of a Kedro environment are incomplete or wrong."""


@dataclass(frozen=True)
class TrackingServer:
    """Where the run is logged, and (for a server with basic auth) as whom."""

    uri: str
    username: str | None = None
    password: str | None = None


def resolve_tracking_uri(uri: str, project_path: Path) -> str:
    """Anchor a relative sqlite or file store at the project root, not the current directory."""
    for scheme in ("sqlite:///", "file:"):
        if uri.startswith(scheme):
            path = uri[len(scheme) :]
            if path and not path.startswith("/"):
                return f"{scheme}{(project_path / path).as_posix()}"
    return uri


def redact(uri: str) -> str:
    """The URI with any password replaced, for logs."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _server_from_entry(entry: Any, key: str, looked_in: list[str]) -> TrackingServer:
    where = " / ".join(looked_in)
    if not isinstance(entry, Mapping):
        raise TrackingConfigError(
            f"The credentials entry '{key}' ({where}) must be a mapping with `tracking_uri` "
            f"or `host`, got {type(entry).__name__}."
        )
    unknown = set(entry) - {"tracking_uri", "host", "port", "scheme", "username", "password"}
    if unknown:
        raise TrackingConfigError(
            f"The credentials entry '{key}' ({where}) has unknown keys {sorted(unknown)}; "
            "known: tracking_uri, host, port, scheme, username, password."
        )
    if entry.get("tracking_uri"):
        uri = str(entry["tracking_uri"])
    elif entry.get("host"):
        scheme = entry.get("scheme") or "http"
        port = f":{entry['port']}" if entry.get("port") else ""
        uri = f"{scheme}://{entry['host']}{port}"
    else:
        raise TrackingConfigError(
            f"The credentials entry '{key}' ({where}) needs `tracking_uri` "
            f"(e.g. http://mlflow.example.org:5000) or `host` (+ optional `port`, `scheme`)."
        )
    username, password = entry.get("username"), entry.get("password")
    if (username is None) != (password is None):
        raise TrackingConfigError(
            f"The credentials entry '{key}' ({where}) has only one of `username` and "
            "`password`; give both (a server started with --app-name basic-auth) or neither."
        )
    return TrackingServer(
        uri=uri,
        username=None if username is None else str(username),
        password=None if password is None else str(password),
    )


def choose_tracking_server(
    settings: Mapping[str, Any],
    credentials: Mapping[str, Any],
    environ: Mapping[str, str],
    looked_in: list[str],
) -> TrackingServer:
    """Apply the precedence of the module docstring.

    `credentials` is the merged credentials config; `looked_in` names the files
    it came from, so that an error says where the entry should go.
    """
    if environ.get(URI_VARIABLE):
        return TrackingServer(uri=environ[URI_VARIABLE])
    key = settings.get("credentials")
    if not key:
        return TrackingServer(uri=str(settings["tracking_uri"]))
    if key not in credentials:
        raise TrackingConfigError(
            f"MLflow tracking: mlflow.yml takes the tracking server from the credentials "
            f"entry '{key}', which is in none of {', '.join(looked_in)}, and {URI_VARIABLE} "
            f"is not set. Either add to conf/local/credentials.yml (git-ignored):\n"
            f"  {key}:\n"
            f"    tracking_uri: http://<host>:<port>\n"
            f"    # username: <you>        # only for a server with --app-name basic-auth\n"
            f"    # password: <secret>\n"
            f"or export {URI_VARIABLE}=http://<host>:<port> (and {USERNAME_VARIABLE} / "
            f"{PASSWORD_VARIABLE} for basic auth). See docs/tracking.md."
        )
    return _server_from_entry(credentials[key], key, looked_in)
