set terminal pngcairo size 900,560
set output 'scaling-lab.png'
set logscale x 2
set xlabel 'ranks (one per host)'
set ylabel 'scaling efficiency (%)'
set yrange [0:105]
set key outside right
set title 'Deep model (48 x Linear(256, 256)), ring collectives, alpha 830 us'
plot 'projection-lab.dat' using 1:(100*$2) with linespoints dt 1 lc 1 title 'DDP, 10 Gb/s', \
     'projection-lab.dat' using 1:(100*$3) with linespoints dt 1 lc 2 title 'PowerSGD, 10 Gb/s', \
     'projection-lab.dat' using 1:(100*$4) with linespoints dt 1 lc 3 title 'FullShard, 10 Gb/s', \
     'projection-lab.dat' using 1:(100*$5) with linespoints dt 2 lc 1 title 'DDP, 25 Gb/s', \
     'projection-lab.dat' using 1:(100*$6) with linespoints dt 2 lc 2 title 'PowerSGD, 25 Gb/s', \
     'projection-lab.dat' using 1:(100*$7) with linespoints dt 2 lc 3 title 'FullShard, 25 Gb/s', \
     'projection-lab.dat' using 1:(100*$8) with linespoints dt 3 lc 1 title 'DDP, 100 Gb/s', \
     'projection-lab.dat' using 1:(100*$9) with linespoints dt 3 lc 2 title 'PowerSGD, 100 Gb/s', \
     'projection-lab.dat' using 1:(100*$10) with linespoints dt 3 lc 3 title 'FullShard, 100 Gb/s'
