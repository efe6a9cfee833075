# The scaling model's prediction (benchmarks/scaling_model.py writes the data file):
#   gnuplot -e "data='benchmarks/scaling_data/prediction.dat'; out='docs/scaling.png'" benchmarks/scaling_model.gp
# Data blocks (gnuplot indexes, two blank lines apart): 0: 100 Gbit/s 25 MiB, 1: 100 Gbit/s 100 MiB,
# 2: 400 Gbit/s 25 MiB, 3: 400 Gbit/s 100 MiB. Columns: ranks hosts rate_gbit size_mib flat_ms
# hier_ms flat_tcp_ms hier_tcp_ms.
if (!exists("data")) data = 'benchmarks/scaling_data/prediction.dat'
if (!exists("out")) out = 'docs/scaling.png'
if (!exists("machine")) machine = 'the first machine (AMD EPYC, 2 cores)'
set terminal pngcairo size 1200,520 font ",11"
set output out
set multiplot layout 1,2 title "flexcomm allreduce, model fitted on ".machine.": 8 ranks per host, one link per host"
set logscale xy 2
set logscale y 10
set xrange [8:1024]
set xtics (8, 16, 32, 64, 128, 256, 512, 1024)
set xlabel "ranks"
set ylabel "allreduce time (ms)"
set grid
set key top left
set title "25 MiB of gradients"
plot data index 0 using 1:5 with linespoints lw 2 pt 7 lc rgb "#c0392b" title "flat ring, 100 Gbit/s", \
     data index 0 using 1:6 with linespoints lw 2 pt 5 lc rgb "#2471a3" title "hierarchical, 100 Gbit/s", \
     data index 2 using 1:5 with linespoints lw 1 dt 2 pt 6 lc rgb "#c0392b" title "flat ring, 400 Gbit/s", \
     data index 2 using 1:6 with linespoints lw 1 dt 2 pt 4 lc rgb "#2471a3" title "hierarchical, 400 Gbit/s"
set title "100 MiB of gradients"
plot data index 1 using 1:5 with linespoints lw 2 pt 7 lc rgb "#c0392b" title "flat ring, 100 Gbit/s", \
     data index 1 using 1:6 with linespoints lw 2 pt 5 lc rgb "#2471a3" title "hierarchical, 100 Gbit/s", \
     data index 3 using 1:5 with linespoints lw 1 dt 2 pt 6 lc rgb "#c0392b" title "flat ring, 400 Gbit/s", \
     data index 3 using 1:6 with linespoints lw 1 dt 2 pt 4 lc rgb "#2471a3" title "hierarchical, 400 Gbit/s"
unset multiplot
