"""The Kubernetes layer of the operator: an API client with bounded timeouts, reading live state,
and applying changes (counted, so a converged reconcile can be shown to make zero writes)."""
