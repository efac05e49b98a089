"""The colocated wing: engines on the trainer's machine read the trainer's tensors in place
(map) or have the trainer write their staging copy (push), through CUDA IPC or CPU shared
memory.  One module per concept (a rank's share of the plan, a link's signals, exports and
mappings) and one class per end (map/push, sender/receiver) built from them, so neither end
carries the other's state.
"""
