"""Local stand-ins for cloud APIs used by the aws and gcp tests (moto's server, a Compute API fake)."""
