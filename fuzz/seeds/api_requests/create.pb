
$
	root/fuzzscratchsim"	è€€job-1