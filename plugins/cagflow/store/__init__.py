"""Where snapshots and releases live: the store backends, the one definition of the store's layout,
release manifests and access counts. Nothing here imports torch: it handles bytes and manifests only."""
