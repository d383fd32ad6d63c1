"""One module per schema revision, named by date so that a listing reads in order."""
