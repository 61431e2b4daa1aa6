"""The node agent: GPU inventory, replica lifecycle, suspend/resume, control API, first-boot capture."""
