"""The local development control plane: built from Go modules, run as local processes."""
