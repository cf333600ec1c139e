"""tierkv.connectors: adapters that plug tierkv into other engines."""
