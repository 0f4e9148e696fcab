"""The Recorder's parts, run on the training thread: its checks, its run's life, steps, updates and summaries."""
