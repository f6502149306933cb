"""The job's health, judged: the agents' samples, arrivals and stacks in; stalls, slow ranks, a hang's verdict and
their words out. Pure: nothing here runs, reads a file or keeps time."""
