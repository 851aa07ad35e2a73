"""The Kedro layer: pipelines wire the catalog to the engine; nothing else lives here."""
