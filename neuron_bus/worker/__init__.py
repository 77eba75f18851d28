"""The worker service: serves one backend's layer range on every route assigned to it."""
