"""Installation and deployment: the torch build for the machine, wheels for offline GPU nodes, DALI from parts,
the check that every module is present, and the GPU measurement session."""
