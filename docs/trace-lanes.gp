# Draws a merged flexcomm trace, one band per rank (rank 0 on top), one lane per thread and
# a last lane for collectives (arrival to completion), from flexcomm-trace-merge --lanes:
#   gnuplot -e "lanes='lanes.dat'; out='trace.png'; from=0; to=0" docs/trace-lanes.gp
# from/to (ms) crop the time axis; 0 and 0 show everything.
if (!exists("lanes")) lanes = 'lanes.dat'
if (!exists("out")) out = 'trace.png'
if (!exists("from")) from = 0
if (!exists("to")) to = 0
if (!exists("title")) title = 'flexcomm trace'
names = system("sed -n 's/^# names: //p' " . lanes)
ranks = system("sed -n 's/^# ranks: //p' " . lanes) + 0

set terminal pngcairo size 1600, 220 + 110 * ranks font ',11'
set output out
set termoption noenhanced  # span names hold underscores
set title title
set xlabel 'time (ms, rank 0 clock)'
set yrange [ranks - 0.5 : -0.5]
set ytics 1
set format y 'rank %g'
set grid xtics
set key outside right top
set style fill solid 0.9 noborder
# Twelve distinct colours (gnuplot's default cycle has eight: names would share them).
colours = '#1f77b4 #ff7f0e #2ca02c #d62728 #9467bd #8c564b #e377c2 #7f7f7f #bcbd22 #17becf #000000 #ffd700'
if (to > from) set xrange [from:to]
plot for [i = 1 : words(names)] lanes \
     using 5 : ($7 == i - 1 ? $3 : 1/0) : 5 : 6 : ($3 - $4) : ($3 + $4) \
     with boxxyerror lc rgb word(colours, (i - 1) % words(colours) + 1) title word(names, i)
