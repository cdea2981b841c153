"""Ray: the actor every Ray rank runs in, and the table of Ray Train's public names."""
