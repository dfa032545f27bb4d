"""atomctl: the command line over atom_core."""
