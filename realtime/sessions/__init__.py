"""What every door's connection is made of: admission and its slot, limits, refusals, the connection."""
