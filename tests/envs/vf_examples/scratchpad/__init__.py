from scratchpad.taskset import ScratchpadTaskset

__all__ = ["ScratchpadTaskset"]
