"""The verbs that take a run id, from any terminal: status, top, logs, report (and its charts), stacks, stop. They
read the run record; stop and stacks ask the run's controller through it."""
