"""The embedded mode (``ance-train run``): a private Redis, every service as a child process."""
