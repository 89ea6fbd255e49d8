"""verl's module names of its experimental trainers (`verl.experimental.*`), so that their command lines run with
`verl` changed to `hybridflow`; each module runs the hybridflow trainer that does the job."""
