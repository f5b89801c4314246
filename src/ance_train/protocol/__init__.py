"""The contract between the services, defined once: events, object keys, tables, work items."""
