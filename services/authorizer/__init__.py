"""The auth callout service: per-job sidecar identities (:mod:`shoal.callout`)."""
