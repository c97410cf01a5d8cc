# Playback FI, Analyzer and Detector (issue: playback and detection).


def playback_targets():
    return []
