"""The live run, in the controller's process: attempts through a target, their supervision (the one stream, the
health loop, stacks, the stop), recovery, and a scheduler's job followed."""
