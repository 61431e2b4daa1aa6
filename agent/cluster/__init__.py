"""The two outside systems behind small interfaces: the registry and the scaler."""
