"""The replica's batching pipeline for encoders and the static generation engine:
``planner`` (input lengths to length-sorted sub-batches within a token budget),
``static`` (one admitted batch: group, plan, run each sub-batch padded to its own
longest row, scatter back) and ``executor`` (the model's one thread, paced by the
model). Never imports ray."""
