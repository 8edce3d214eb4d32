/*
 * A model of a proxy thread sharing one CPU with a caller that spins without
 * yielding (docs/BENCHMARKS.md, "The shared fallback naps"). Thread
 * "caller" spins on CPU 0; thread "proxy" on CPU 0 waits for an event word
 * that the main thread (CPU 1) sets every 5 ms; the time from the event to
 * the proxy seeing it is recorded. Modes: 0 = arx's Adaptive wait before
 * (64 hot polls, 2000 sched_yield, then 50 us naps); 1 = naps only of the
 * given length (default timer slack); 2 = naps, timer slack 1 us; 3 =
 * naps, timer slack 10 us (what arx does now, with 20 us naps).
 *
 *   gcc -O2 -pthread nap.c -o nap && ./nap 0 && ./nap 3 20000
 *
 * Output on the build machine (Linux 6.18, 2 cores, 2026-12-04), one line
 * per run:
 *   mode 0 nap 20000: n=399 median 2051.3 us p90 3632.2 max 4012.8
 *   mode 1 nap 20000: n=399 median 44.0 us p90 83.9 max 4758.1
 *   mode 1 nap 10000: n=399 median 42.1 us p90 67.3 max 1731.6
 *   mode 2 nap 20000: n=399 median 19.6 us p90 701.6 max 5056.1
 *   mode 2 nap 5000: n=395 median 38.5 us p90 3305.1 max 4721.5
 *   mode 3 nap 20000: n=399 median 26.4 us p90 48.3 max 3320.8
 *   mode 3 nap 20000: n=399 median 26.5 us p90 48.0 max 3386.3
 *   mode 3 nap 20000: n=399 median 25.5 us p90 47.6 max 3875.0
 *   mode 3 nap 30000: n=399 median 32.1 us p90 52.1 max 3700.0
 * (Shorter naps with a 1 us slack wake so often that the scheduler stops
 * letting the napper preempt: worse p90.)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>
static atomic_long ev; static atomic_int stop_;
static long now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000L+t.tv_nsec;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static int mode; static long napns=20000;
static long lat[200000]; static int nlat;
static void* caller(void*a){pin(0); while(!atomic_load(&stop_)){ } return 0;}
static void* proxy(void*a){pin(0); if(mode>=2) prctl(PR_SET_TIMERSLACK,mode==2?1000:10000,0,0,0);
  long seen=0; int rounds=0;
  while(!atomic_load(&stop_)){ long e=atomic_load(&ev); if(e!=seen && e!=0){ lat[nlat++]=now()-e; seen=e; rounds=0; continue;}
    rounds++;
    if(mode==0){ if(rounds<64) ; else if(rounds<64+2000) sched_yield(); else {struct timespec t={0,50000}; nanosleep(&t,0);} }
    else { struct timespec t={0,napns}; clock_nanosleep(CLOCK_MONOTONIC,0,&t,0);} }
  return 0;}
int main(int c,char**v){mode=atoi(v[1]); if(c>2) napns=atol(v[2]);
 pthread_t a,b; pthread_create(&a,0,caller,0); pthread_create(&b,0,proxy,0);
 pin(1); for(int i=0;i<400;i++){ usleep(5000); atomic_store(&ev,now()); }
 atomic_store(&stop_,1); pthread_join(a,0); pthread_join(b,0);
 // sort
 for(int i=0;i<nlat;i++)for(int j=i+1;j<nlat;j++)if(lat[j]<lat[i]){long t=lat[i];lat[i]=lat[j];lat[j]=t;}
 printf("mode %d nap %ld: n=%d median %.1f us p90 %.1f max %.1f\n",mode,napns,nlat,lat[nlat/2]/1e3,lat[nlat*9/10]/1e3,lat[nlat-1]/1e3);}
