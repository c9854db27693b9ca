"""The experiment runner: does computing dX from updated weights train faster?

Run ``python -m immgrad.experiments --help``. It needs the ``experiments``
extra (scikit-learn, matplotlib, tqdm): ``pip install "immgrad[experiments]"``.
"""
