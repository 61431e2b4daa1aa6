"""The front door: TCP server, router, admission controller."""
