"""What the demo and the report share to measure on a busy machine and to show it: layer
times robust to load, runs in turns with verdicts that say when noise hides one, progress,
sparklines and markdown documents."""
