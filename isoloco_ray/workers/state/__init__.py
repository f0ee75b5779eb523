"""A run's state on storage:

    checkpoint_manager.py  the state's parts, which worker writes which file
    checkpoint.py          the files' formats, what a checkpoint needs, the checks of a
                           checkpoint read back, hashes
    resume.py              which checkpoint a worker group resumes from (newest intact)
    export.py              the trained model as a Hugging Face directory
"""
