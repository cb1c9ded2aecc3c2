"""Runtime modes (`runtime=`): when groups start, how many are resident, when a step closes.

Strategies (`sync`, `prelaunch`, `partial`, `fully_async`) drive groups through `stages.Pipeline` with one
`GroupPool`; the config group keeps the user-facing name `runtime=`.
"""
