"""The run record: a run's directory on disk and everything in it (its schema, paths, the user's index of runs,
the timed stream and the timeline, written atomically), and whether a run still runs. Read by every verb, written
by the controller."""
