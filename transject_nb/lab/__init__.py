"The lab: the comparison protocol and its studies, the analyses, statistics, the claims ledger and the benchmarks."
