#!/usr/bin/env bash
# Once per account and region, before `ray up cluster.yaml` (docs/tutorials/cluster.md, "The roles, the network and the
# security group"): checks the bucket, makes the two roles and their instance profiles (aws/iam/*.json), finds or makes
# a VPC whose subnets give instances public IPs in cluster.yaml's zones (Ray launches only into such subnets), makes the
# security group, gives the head's role the right to launch workers into that VPC with that group alone, and writes the
# bucket, the security group and (where still a placeholder) the newest Deep Learning AMI into cluster.yaml. The region
# and zones are cluster.yaml's (provider.region, provider.availability_zone), where Ray launches.
#
#   bash aws/setup.sh MY-BUCKET [REGION]          # REGION, if given, must be cluster.yaml's; VPC=vpc-... for your own
#
# Run it again at will: what exists is kept, and what an earlier run left half-made is checked and completed (an
# instance profile without its role, a security group without its rules, the m2d-ray VPC without its gateway, route
# or subnets). It stops at the first command that fails (set -e), saying which; edits are sed without -i (GNU and
# macOS sed differ there). tests/unit/test_cluster_build.py runs it against a stand-in `aws`.
set -euo pipefail
trap 'echo "m2d: aws/setup.sh stopped at line $LINENO: $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."
BUCKET=${1:?usage: bash aws/setup.sh BUCKET [REGION]}
tmp=$(mktemp -d)
edit() { # FILE SED-EXPRESSION: an in-place edit that GNU and BSD (macOS) sed both run
  sed "$2" "$1" >"$tmp/edit" && cat "$tmp/edit" >"$1"
}
has() { # LIST ITEM: whether the whitespace-separated LIST (aws --output text) holds ITEM
  local item
  for item in $1; do [ "$item" = "$2" ] && return 0; done
  return 1
}

# The region and zones, from cluster.yaml and checked before any AWS call: a network made elsewhere is one Ray never uses.
REGION=$(sed -n 's/^  region: *//p' cluster.yaml)
zones=$(sed -n 's/^ *availability_zone: *//p' cluster.yaml | tr ',' ' ')
if [ -z "$REGION" ] || [ -z "$zones" ]; then
  echo "m2d: cluster.yaml has no provider.region or availability_zone" >&2
  exit 1
fi
if [ -n "${2:-}" ] && [ "$2" != "$REGION" ]; then
  echo "m2d: cluster.yaml's provider.region is $REGION, not $2: set provider.region and availability_zone (zones of" \
    "$2) in cluster.yaml, then run bash aws/setup.sh $BUCKET again" >&2
  exit 1
fi
for zone in $zones; do
  case "$zone" in
    "$REGION"?*) ;;
    *)
      echo "m2d: cluster.yaml's availability_zone $zone is not in its provider.region $REGION: give zones of $REGION" >&2
      exit 1
      ;;
  esac
done

ACCOUNT=$(aws sts get-caller-identity --query Account --output text)
echo "account $ACCOUNT, region $REGION (cluster.yaml), zones $zones, bucket $BUCKET"

# The bucket first: everything after it (the wheel cache, the run's storage) needs it.
if ! aws s3api head-bucket --bucket "$BUCKET" --region "$REGION"; then
  echo "m2d: s3://$BUCKET is not a bucket these credentials reach: make it with aws s3 mb s3://$BUCKET --region $REGION" >&2
  exit 1
fi

# The roles: the workers' (the bucket alone) and the head's (the bucket, and launching this cluster's workers, once the
# network below is known). A profile an earlier run made but left without its role gets it now.
new_profile=false
for role in m2d-ray-head m2d-ray-worker; do
  if ! aws iam get-role --role-name "$role" >/dev/null 2>&1; then
    aws iam create-role --role-name "$role" --assume-role-policy-document file://aws/iam/ec2-trust.json >/dev/null
  fi
  if ! holds=$(aws iam get-instance-profile --instance-profile-name "$role" \
    --query 'InstanceProfile.Roles[].RoleName' --output text 2>/dev/null); then
    aws iam create-instance-profile --instance-profile-name "$role" >/dev/null
    holds=
  fi
  if ! has "$holds" "$role"; then
    aws iam add-role-to-instance-profile --instance-profile-name "$role" --role-name "$role"
    new_profile=true
  fi
  sed "s/MY-BUCKET/$BUCKET/g" aws/iam/bucket.json >"$tmp/bucket.json"
  aws iam put-role-policy --role-name "$role" --policy-name run-bucket --policy-document "file://$tmp/bucket.json"
done
# spot workers need EC2's spot service-linked role, once per account
if ! aws iam get-role --role-name AWSServiceRoleForEC2Spot >/dev/null 2>&1; then
  aws iam create-service-linked-role --aws-service-name spot.amazonaws.com >/dev/null
fi
# IAM is eventually consistent: EC2 can refuse a new instance profile ("Invalid IAM Instance Profile name") for a minute
# or more after IAM has it, and Ray's launch retries at once; wait until IAM has it, then a minute.
for role in m2d-ray-head m2d-ray-worker; do
  aws iam wait instance-profile-exists --instance-profile-name "$role"
done
if [ "$new_profile" = true ]; then
  echo "waiting ${M2D_PROFILE_WAIT:-60} s for EC2 to see the new instance profiles"
  sleep "${M2D_PROFILE_WAIT:-60}"
fi

# The network: Ray launches into subnets of the security group's VPC, in cluster.yaml's zones, that give instances a
# public IP (MapPublicIpOnLaunch; the laptop reaches the head by SSH). The default VPC's subnets do; many organisation
# accounts have no default VPC, so then one is made (tag Name=m2d-ray): an internet gateway, a public route in its main
# route table, a subnet per zone. Each piece of that VPC is checked on every run, and what is missing made.
VPC=${VPC:-$(aws ec2 describe-vpcs --region "$REGION" --filters Name=is-default,Values=true --query 'Vpcs[0].VpcId' --output text)}
ours=false
if [ "$VPC" = None ]; then
  VPC=$(aws ec2 describe-vpcs --region "$REGION" --filters Name=tag:Name,Values=m2d-ray --query 'Vpcs[0].VpcId' --output text)
  ours=true
fi
if [ "$VPC" = None ]; then
  echo "no default VPC in $REGION: making one (m2d-ray, 10.42.0.0/16) with a public subnet in each of: $zones"
  VPC=$(aws ec2 create-vpc --region "$REGION" --cidr-block 10.42.0.0/16 \
    --tag-specifications 'ResourceType=vpc,Tags=[{Key=Name,Value=m2d-ray}]' --query Vpc.VpcId --output text)
  aws ec2 wait vpc-available --region "$REGION" --vpc-ids "$VPC"
fi
if [ "$ours" = true ]; then
  aws ec2 modify-vpc-attribute --region "$REGION" --vpc-id "$VPC" --enable-dns-hostnames
  igw=$(aws ec2 describe-internet-gateways --region "$REGION" --filters "Name=attachment.vpc-id,Values=$VPC" \
    --query 'InternetGateways[0].InternetGatewayId' --output text)
  if [ "$igw" = None ]; then
    igw=$(aws ec2 create-internet-gateway --region "$REGION" \
      --tag-specifications 'ResourceType=internet-gateway,Tags=[{Key=Name,Value=m2d-ray}]' \
      --query InternetGateway.InternetGatewayId --output text)
    aws ec2 attach-internet-gateway --region "$REGION" --internet-gateway-id "$igw" --vpc-id "$VPC"
  fi
  routes=$(aws ec2 describe-route-tables --region "$REGION" \
    --filters "Name=vpc-id,Values=$VPC" Name=association.main,Values=true --query 'RouteTables[0].RouteTableId' --output text)
  out=$(aws ec2 describe-route-tables --region "$REGION" --route-table-ids "$routes" \
    --query "RouteTables[0].Routes[?DestinationCidrBlock=='0.0.0.0/0'].GatewayId" --output text)
  if ! has "$out" "$igw"; then
    aws ec2 create-route --region "$REGION" --route-table-id "$routes" --destination-cidr-block 0.0.0.0/0 \
      --gateway-id "$igw" >/dev/null
  fi
  n=0
  for zone in $zones; do
    subnet=$(aws ec2 describe-subnets --region "$REGION" \
      --filters "Name=vpc-id,Values=$VPC" "Name=availability-zone,Values=$zone" --query 'Subnets[0].SubnetId' --output text)
    if [ "$subnet" = None ]; then
      subnet=$(aws ec2 create-subnet --region "$REGION" --vpc-id "$VPC" --availability-zone "$zone" \
        --cidr-block "10.42.$((n * 16)).0/20" --tag-specifications 'ResourceType=subnet,Tags=[{Key=Name,Value=m2d-ray}]' \
        --query Subnet.SubnetId --output text)
    fi
    aws ec2 modify-subnet-attribute --region "$REGION" --subnet-id "$subnet" --map-public-ip-on-launch
    n=$((n + 1))
  done
fi
public=$(aws ec2 describe-subnets --region "$REGION" \
  --filters "Name=vpc-id,Values=$VPC" Name=map-public-ip-on-launch,Values=true \
  "Name=availability-zone,Values=$(echo "$zones" | tr ' ' ',')" --query 'length(Subnets)' --output text)
if [ "$public" = 0 ]; then
  echo "m2d: $VPC has no subnet in $zones that gives instances a public IP, and Ray launches into none other: set" \
    "MapPublicIpOnLaunch on one (aws ec2 modify-subnet-attribute --map-public-ip-on-launch) or run with another VPC=" >&2
  exit 1
fi

# The security group: SSH from this address, all traffic between the cluster's nodes. Both rules are checked on every
# run (an earlier one may have stopped between the group and its rules; a run from another address adds that address).
SG=$(aws ec2 describe-security-groups --region "$REGION" --filters "Name=vpc-id,Values=$VPC" Name=group-name,Values=m2d-ray \
  --query 'SecurityGroups[0].GroupId' --output text)
if [ "$SG" = None ]; then
  SG=$(aws ec2 create-security-group --region "$REGION" --vpc-id "$VPC" --group-name m2d-ray \
    --description "m2d-ray: SSH from one address, all traffic between the cluster's nodes" --query GroupId --output text)
fi
ip=$(curl -sf https://checkip.amazonaws.com)
rules=$(aws ec2 describe-security-groups --region "$REGION" --group-ids "$SG" \
  --query "SecurityGroups[0].IpPermissions[?FromPort==\`22\`].IpRanges[].CidrIp" --output text)
if ! has "$rules" "$ip/32"; then
  aws ec2 authorize-security-group-ingress --region "$REGION" --group-id "$SG" --protocol tcp --port 22 \
    --cidr "$ip/32" >/dev/null
fi
rules=$(aws ec2 describe-security-groups --region "$REGION" --group-ids "$SG" \
  --query "SecurityGroups[0].IpPermissions[?IpProtocol=='-1'].UserIdGroupPairs[].GroupId" --output text)
if ! has "$rules" "$SG"; then
  aws ec2 authorize-security-group-ingress --region "$REGION" --group-id "$SG" --protocol -1 --source-group "$SG" >/dev/null
fi

# The head's launch rights, now that the network is known: this cluster's worker types, into this VPC, with this group.
sed "s/MY-ACCOUNT/$ACCOUNT/g; s/MY-VPC/$VPC/g; s/MY-SG/$SG/g" aws/iam/head-launch.json >"$tmp/head-launch.json"
aws iam put-role-policy --role-name m2d-ray-head --policy-name launch-workers \
  --policy-document "file://$tmp/head-launch.json"

# cluster.yaml: the bucket, the security group, and the newest Deep Learning AMI if none is set yet.
edit cluster.yaml "s/MY-BUCKET/$BUCKET/g; s/sg-REPLACE_WITH_M2D_SG/$SG/"
if grep -q ami-REPLACE_WITH_DLAMI_ID cluster.yaml; then
  ami=$(aws ec2 describe-images --region "$REGION" --owners amazon \
    --filters 'Name=name,Values=Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)*' \
    --query 'sort_by(Images,&CreationDate)[-1].ImageId' --output text)
  edit cluster.yaml "s/ami-REPLACE_WITH_DLAMI_ID/$ami/"
  aws ec2 describe-images --region "$REGION" --image-ids "$ami" --query 'Images[0].Description' --output text
  echo "check that the AMI above has CUDA 13 and an NVIDIA driver >= 580 (cluster.yaml, AMI)"
fi
echo "done: region $REGION, VPC $VPC, security group $SG; cluster.yaml names them. Next: ray up cluster.yaml"
