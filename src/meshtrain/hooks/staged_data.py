"""A refused run leaves data/ as it found it: the data pipeline's folders are written
beside their place and committed only when the run gets past its checks."""

from __future__ import annotations

from typing import Any

from kedro.framework.hooks import hook_impl

from meshtrain.pipelines.catalog_io import StagedFolder
from meshtrain.pipelines.run_config import TRAINS


class StagedDataHook:
    """Commits the staged folders (`catalog_io.StagedFolder`) before the training node
    reads them (its workers open the files by path, and a failure from there on keeps
    the data it trained on, for a resume) or when the pipeline ends; discards them when
    the run fails before that."""

    def __init__(self) -> None:
        self._folders: list[StagedFolder] = []

    @hook_impl
    def before_pipeline_run(self, catalog: Any) -> None:
        self._folders = [
            dataset
            for name in catalog.keys()  # noqa: SIM118 - a catalog, not a dict
            if isinstance(dataset := catalog[name], StagedFolder)
        ]

    @hook_impl
    def before_dataset_loaded(self, dataset_name: str, node: Any) -> None:
        if TRAINS in node.tags:
            self._commit()

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._commit()

    @hook_impl
    def on_pipeline_error(self) -> None:
        for folder in self._folders:
            folder.discard()

    def _commit(self) -> None:
        for folder in self._folders:
            folder.commit()
