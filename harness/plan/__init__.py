"""Pure planning: a spec (and hosts) become per-node commands, and the commands text. Nothing here runs anything."""
