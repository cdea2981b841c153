"""lockstep's internals: not part of the public API."""
