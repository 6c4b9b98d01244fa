"""One router per resource: configs, tables, health."""
