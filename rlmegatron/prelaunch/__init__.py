"""Everything checked before the first worker starts, for every command that reads a job spec (`rlm validate`,
`train`, `plan`): the spec pipeline's stages and the preflight's look at the files and models the spec names."""
