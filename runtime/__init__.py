"""What mtrl needs from the machine, with no RL knowledge: child processes that never outlive
mtrl, a block's peak memory, file digests and version hashes, the interpreter's start and exit,
phase timings, Ray. Stages and the pipeline import it; it imports nothing of mtrl above schemas/.

No module here shapes a stage's output, so stage versions never hash this folder (the stage
table's closures stop at it): editing a launcher or a sampler keeps every cached version."""
