"""Loader states the resume tests share."""

#: A state written by fastloader 0.1 in the middle of epoch 0, after 5 batches (version 1:
#: batches, not samples). A copy of it is the test's to change.
VERSION_1_MID_EPOCH = {
    "fastloader_state_version": 1,
    "seed": 3,
    "epoch": 0,
    "epoch_started": True,
    "batches_consumed": 5,
    "epoch_complete": False,
}
