"""Infrastructure the services share: the Redis event bus, the object store, gRPC, credentials."""
